"""The service: admission, request table, stages, gRPC server, and a local launcher."""
