-- The app's own PostgreSQL role on the Entra-only server infra/main.bicep deploys (deployPostgres=true).
--
-- Run once after the deployment, as the server's Microsoft Entra administrator (postgresAdminName),
-- connected to the postgres database; the values come from the deployment's outputs:
--
--   export PGPASSWORD="$(az account get-access-token --resource-type oss-rdbms --query accessToken -o tsv)"
--   psql "host=<postgresFullyQualifiedDomainName> dbname=postgres user=<postgresAdminName> sslmode=require" \
--     -v app_role=<postgresAppRole> -v database=queueing -v schema=<postgresSchema> \
--     -f infra/postgres/app-role.sql
--
-- It creates the role for the app's managed identity (pgaadauth_create_principal maps a role to the
-- Entra principal of the same name: the identity's name) and one schema that role owns, where the kit
-- creates and migrates its tables. Nothing more: the role is no administrator, cannot create roles,
-- databases or other schemas, and has no rights on other schemas. Running it again changes nothing.
-- tests/infra/test_provisioned.py runs this file with psql against a real PostgreSQL.

\set ON_ERROR_STOP on

SELECT pgaadauth_create_principal(:'app_role', false, false)
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'app_role');

\connect :database

CREATE SCHEMA IF NOT EXISTS :"schema" AUTHORIZATION :"app_role";
