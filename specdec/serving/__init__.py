"""Serving floor: gRPC plumbing, error mapping, backends, batching and settings (never torch and grpc in one module)."""
