"""The routing decision: prompt blocks, ledger match, predicted blocks, scoring, prefill/decode
pairing.
"""
