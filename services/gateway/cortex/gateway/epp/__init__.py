"""The Envoy endpoint picker (ext_proc) answered by Cortex's own routing.
"""
