"""Commands for a running stack that stay out of the `magnitude` CLI: the compose healthcheck (light: no model
runtime) and key making (run inside containers too). Run them through their wrappers, `scripts/ops/health` and
`scripts/ops/keys`."""
