"""The shared HTTP layer every wing stands on: bounded body reading, the guard (who calls, may they), the
disconnect probe, the error shapes, the OpenAPI builder, uvicorn's protocol class, the server and the API's
/docs page. No route of a wing lives here, and nothing here imports a wing or the wiring (app, cli, runtime)."""
