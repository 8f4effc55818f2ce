"""The classify wing: `POST /v1/classify` (vLLM's shape) and `POST /predict` (TEI's shape) on any
sequence-classification model (a folder whose task is classification)."""
