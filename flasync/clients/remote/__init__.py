"""Remote clients: the HTTP transport on the server's side and the device's httpx client."""
