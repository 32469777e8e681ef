"""Generated gRPC contracts (betterproto for grpclib). Regenerate with `make proto`."""
