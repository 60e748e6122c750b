"""The only place that knows HTTP/gRPC: KServe v2, OpenAI, /metrics, error mapping."""
