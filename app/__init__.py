"""attnlab web layer: FastAPI app, routes, schemas, settings and the inference runtime."""
