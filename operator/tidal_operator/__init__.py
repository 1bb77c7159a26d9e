"""Tidal's scaling controller: a pure snapshot, a pure policy, and the kopf operator around them."""
