"""Generated gRPC stubs for the wire contracts in proto/ (regenerate with scripts/gen-protos)."""
