"""The server's own web pages: a chat page at / and a live status page at /status (routes.py), static
files shipped in the package (static/) that talk to the server through its public API only."""
