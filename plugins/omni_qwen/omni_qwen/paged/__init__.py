"""The paged KV backend: a runtime-owned pool of K/V blocks and one flattened Qwen2 forward per engine step.

pool.KVPool owns the K/V tensor, qwen2.PagedQwen2 runs the model over it, batch.StepBatch turns the
scheduler's chunks into index tensors once per step, executor.PagedARExecutor drives it from the kernel
Engine with an ARScheduler, and engine.build_paged_engine wires them together.
"""
