"""The HTTP face: routes, bounded body reading, the protocol class, the OpenAPI document and the server."""
