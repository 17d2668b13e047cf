"""Device meshes and sharding rules (parameters are annotated by path here, never inside layers)."""
