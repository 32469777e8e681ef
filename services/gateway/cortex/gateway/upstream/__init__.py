"""Calls to workers: the HTTP client and SSE framing.
"""
