"""What the worker serves: gRPC services, the OpenAI layer, the router, auth, metrics."""
