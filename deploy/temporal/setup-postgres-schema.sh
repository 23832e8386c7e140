#!/bin/sh
# Creates (or upgrades) the Temporal server's two Postgres databases: persistence and visibility.
# Runs in the temporalio/admin-tools image (temporal-sql-tool and the schema files are there), once
# per `docker compose up`; every step is idempotent, so re-running it on an existing database only
# applies the schema versions it lacks. Replaces the deprecated temporalio/auto-setup image.
set -eu

HOST="${POSTGRES_SEEDS:-temporal-db}"
PORT="${DB_PORT:-5432}"
USER="${POSTGRES_USER:-temporal}"
export SQL_PASSWORD="${POSTGRES_PWD:?set POSTGRES_PWD}"
SCHEMA_DIR=/etc/temporal/schema/postgresql/v12

for db in temporal:temporal temporal_visibility:visibility; do
  name="${db%%:*}"
  schema="${db#*:}"
  tool="temporal-sql-tool --plugin postgres12 --ep $HOST -p $PORT -u $USER --db $name"
  $tool create || echo "database $name exists"
  # setup-schema -v 0.0 only creates the version table; update-schema applies every version after it.
  $tool setup-schema -v 0.0 || echo "schema of $name already initialised"
  $tool update-schema -d "$SCHEMA_DIR/$schema/versioned"
  echo "database $name at the latest schema"
done
