"""The HTTP server's own modules (server.py is the entry point): the OpenAI protocol, the chat template,
Prometheus metrics and the dashboard. The engine (engine/) never imports these."""
