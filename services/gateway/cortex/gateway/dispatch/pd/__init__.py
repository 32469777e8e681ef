"""Prefill/decode dispatch: the pair's legs, the handoff on the wire, the dispatcher.
"""
