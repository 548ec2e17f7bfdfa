"""The request path: plan, graph, scheduler, stage, engine, the AR and step schedulers, KV blocks, requests,
events, errors, protocols and params. It imports nothing above it (the plugin host, the API, the CLI)."""
