"""Generated gRPC contracts (protobuf messages, grpclib stubs). Regenerate with `make proto`."""
