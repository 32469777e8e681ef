"""Request bodies into validated requests, and a model's request bounds (pure).
"""
