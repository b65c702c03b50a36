"""The target service: verifies draft tokens in one forward pass (gRPC TargetService)."""
