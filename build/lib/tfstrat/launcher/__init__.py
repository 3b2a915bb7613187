"""`tfstrat launch`, TensorFlow-free: `api` (LaunchConfig, launch), `tasks` (task processes,
their output and failure reports), `watch` (the watcher each task runs under), `netns` and
`private_network` (`--private-network`), `inner` (the launcher inside the namespace)."""
