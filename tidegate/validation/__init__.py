"""OpenAI request bodies checked before anything is published (sans-I/O):
used by the edge for every route and by the dispatcher for batch lines."""
