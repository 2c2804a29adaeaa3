"""The scheduler service: placement of requests on (prefill, decode) worker pairs (`python -m services.scheduler`)."""
