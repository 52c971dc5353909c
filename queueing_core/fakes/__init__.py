"""In-memory stand-ins for cloud messaging services, for tests that cannot reach the real thing."""
