"""pagoda.router: one entry point in front of many `pagoda serve` replicas, routing each request to the
replica where it is cheapest to serve (its cached prefix, on which tier, and the replica's load).

Importing it needs no torch (it runs from the engine image but stays light); see docs/router.md.
"""
