"""The gateway: runs the speculative loop between the draft and target services (gRPC GenerationService)."""
