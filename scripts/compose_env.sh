#!/usr/bin/env bash
# Writes .env next to compose.yaml with a random secret for each variable compose.yaml needs:
# the admin API key and every service's NATS password. Run once; an existing .env is kept.
# Read the admin key with: grep SHOAL_ADMIN_API_KEYS .env
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -e .env ]; then
  echo ".env exists; keeping it" >&2
  exit 0
fi
umask 077
for name in SHOAL_ADMIN_API_KEYS SHOAL_NATS_GATEWAY_PASSWORD SHOAL_NATS_SCHEDULER_PASSWORD \
            SHOAL_NATS_NODE_AGENT_PASSWORD SHOAL_NATS_WORKER_PASSWORD SHOAL_NATS_ADMIN_PASSWORD; do
  echo "$name=$(openssl rand -hex 24)"
done > .env
echo "wrote .env (the admin API key is SHOAL_ADMIN_API_KEYS)" >&2
