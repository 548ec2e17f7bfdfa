"""The paged KV backend's model side: a runtime-owned pool of K/V blocks and one flattened decoder forward per
engine step.

pool.KVPool owns the K/V tensor, batch.build_step turns the scheduler's chunks into the index tensors every
layer reuses, and decoder.PagedDecoder runs the model over them. backends.PagedBackend (one level up) plugs them
under the shared ARModelRunner; build.build_stage sizes the pool and wires the stage's Engine.
"""
