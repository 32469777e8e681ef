"""HTTP in front of everything: the ASGI contract, the request view and responses, the listener,
client auth, CORS, the access log, admission control.
"""
