"""The inference wing: POST /v1/inference, GET /v1/requests/{id}, GET /v1/models, and the operational routes."""
