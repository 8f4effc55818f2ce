"""Deployment files: nginx (deploy/nginx), Kubernetes (deploy/k8s). Python here only renders and runs them."""
