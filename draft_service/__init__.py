"""The draft service: proposes draft tokens (gRPC DraftService)."""
