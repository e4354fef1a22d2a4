"""The HTTP server's own machinery every route shares: route declarations and body decoding, errors,
the access log, metrics, connection limits and the load gate."""
