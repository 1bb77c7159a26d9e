"""Pure planning for Tidal: layouts and the pipeline IR. No torch, no kopf."""
