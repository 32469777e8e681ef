"""The gateway's one configuration object and its sections (frozen, validated).
"""
