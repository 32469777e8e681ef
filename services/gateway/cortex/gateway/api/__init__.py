"""The endpoints: inference, passthrough relay, admin, operations, tokenize, and the decision
headers every answer carries.
"""
