"""Remote clients over HTTP: in-process apps, uvicorn servers and `flasync serve`/`client` processes."""
