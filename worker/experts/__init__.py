"""Mixture-of-experts layers whose experts live on the servers (docs/moe.md): the layer, token routing, the
"send" placement, the per-step choice, the auxiliary loss."""
