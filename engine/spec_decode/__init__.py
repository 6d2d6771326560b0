"""Speculative decoding: proposers guess the next tokens, one forward pass scores them, and acceptance
keeps exactly the tokens (greedy) or exactly the distribution (sampling) that decoding one token at a time
would give."""
