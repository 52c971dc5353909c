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
-- From outside Azure the server's firewall must admit your address first (postgresClientIpAddress, or
-- run psql from Cloud Shell): infra/README.md.
--
-- "permission denied for database" on CREATE SCHEMA: the database was created before the server had its
-- Entra administrator (earlier versions of the template did that), so the platform's superuser owns it.
-- infra/README.md ("A database made before its administrator") says how to check and what to do.
--
-- It creates the role for the app's managed identity (pgaadauth_create_principal maps a role to the
-- Entra principal of the same name: the identity's name) and one schema where that role may create
-- objects, where the kit creates and migrates its tables (which the role then owns). Nothing more: the
-- role is no administrator, cannot create roles, databases or other schemas, and has no rights on other
-- schemas. Running it again changes nothing.
--
-- The administrator keeps the schema: on Azure it is no superuser, and not a member of the role it has
-- just created, so it cannot make that role the schema's owner (CREATE SCHEMA ... AUTHORIZATION needs
-- membership). The kit needs no more than USAGE and CREATE there.
-- tests/infra/test_provisioned.py runs this file with psql against a real PostgreSQL, as a superuser and
-- as an administrator made as Azure makes one, and the kit then migrates and works as the role.

\set ON_ERROR_STOP on

SELECT pgaadauth_create_principal(:'app_role', false, false)
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'app_role');

\connect :database

CREATE SCHEMA IF NOT EXISTS :"schema";
GRANT USAGE, CREATE ON SCHEMA :"schema" TO :"app_role";
