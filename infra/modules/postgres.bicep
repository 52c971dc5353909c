// Optional PostgreSQL flexible server for the kit's `sql` provider. Microsoft Entra
// authentication only: there is no admin password anywhere. The deploying user or group becomes the
// Entra administrator, never the app; the app signs in as a role of its own, created by that
// administrator with infra/postgres/app-role.sql (pgaadauth_create_principal maps it to the app's
// managed identity by name).
//
// One step at a time, in this order: server, Entra administrator, firewall rules, database.
// - A database ARM creates before the server has an Entra administrator is owned by the platform's
//   superuser (azuresu), in which the administrator may create no schema: app-role.sql then fails,
//   and nobody but Microsoft can change the owner. Created after, the administrator owns it
//   (Azure/bicep-registry-modules#3596, hashicorp/terraform-provider-azurerm#27895).
// - The server refuses a change while another one is in progress, so no two of its child resources
//   are created at once: each waits for the one before it.

@description('Azure region for the resources.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Server name (3-63 lowercase letters, digits and hyphens, globally unique).')
@minLength(3)
@maxLength(63)
param serverName string

@description('PostgreSQL major version.')
@allowed([
  '14'
  '15'
  '16'
])
param version string = '16'

@description('Compute SKU name, e.g. Standard_B1ms (Burstable) or Standard_D2ds_v5 (GeneralPurpose).')
param skuName string = 'Standard_B1ms'

@description('Compute tier matching skuName.')
@allowed([
  'Burstable'
  'GeneralPurpose'
  'MemoryOptimized'
])
param skuTier string = 'Burstable'

@description('Storage size in GiB.')
@minValue(32)
param storageSizeGB int = 32

@description('Days of automated backups.')
@minValue(7)
@maxValue(35)
param backupRetentionDays int = 7

@description('Database the kit uses.')
param databaseName string = 'queueing'

@description('A public IPv4 address admitted besides traffic from inside Azure: the deployer\'s, for psql to run infra/postgres/app-role.sql. Empty: none.')
param clientIpAddress string = ''

@description('Object id of the Entra user, group or service principal to make administrator.')
param adminPrincipalId string

@description('Display name of that principal (a user principal name, or the group\'s name).')
param adminPrincipalName string

@description('What the principal is.')
@allowed([
  'User'
  'Group'
  'ServicePrincipal'
])
param adminPrincipalType string = 'User'

resource server 'Microsoft.DBforPostgreSQL/flexibleServers@2024-08-01' = {
  name: serverName
  location: location
  tags: tags
  sku: {
    name: skuName
    tier: skuTier
  }
  properties: {
    version: version
    authConfig: {
      activeDirectoryAuth: 'Enabled'
      passwordAuth: 'Disabled'
      tenantId: tenant().tenantId
    }
    storage: {
      storageSizeGB: storageSizeGB
      autoGrow: 'Enabled'
    }
    backup: {
      backupRetentionDays: backupRetentionDays
      geoRedundantBackup: 'Disabled'
    }
    highAvailability: {
      mode: 'Disabled'
    }
    network: {
      publicNetworkAccess: 'Enabled'
    }
  }
}

// First of the server's children: the database must find an administrator to own it (see above).
resource admin 'Microsoft.DBforPostgreSQL/flexibleServers/administrators@2024-08-01' = {
  parent: server
  name: adminPrincipalId
  properties: {
    principalName: adminPrincipalName
    principalType: adminPrincipalType
    tenantId: tenant().tenantId
  }
}

// The Flex Consumption app has no fixed outbound address without a VNet: admit Azure-internal
// traffic only (the 0.0.0.0 rule); authentication still requires an Entra token.
resource allowAzureServices 'Microsoft.DBforPostgreSQL/flexibleServers/firewallRules@2024-08-01' = {
  parent: server
  name: 'AllowAllAzureServicesAndResourcesWithinAzureIps'
  properties: {
    startIpAddress: '0.0.0.0'
    endIpAddress: '0.0.0.0'
  }
  // one change to the server at a time
  dependsOn: [
    admin
  ]
}

// The administrator runs infra/postgres/app-role.sql with psql after the deployment; from outside Azure
// the server refuses every address no rule admits. Only when asked for, one address, deleted after use.
resource allowClient 'Microsoft.DBforPostgreSQL/flexibleServers/firewallRules@2024-08-01' = if (!empty(clientIpAddress)) {
  parent: server
  name: 'AllowDeployerClientIp'
  properties: {
    startIpAddress: clientIpAddress
    endIpAddress: clientIpAddress
  }
  // one firewall change at a time: the server refuses a second while one is in progress
  dependsOn: [
    allowAzureServices
  ]
}

// Last: after the administrator (who then owns it) and after the firewall changes. ARM drops the
// client rule from the list when it is not deployed, so both rules are named.
resource database 'Microsoft.DBforPostgreSQL/flexibleServers/databases@2024-08-01' = {
  parent: server
  name: databaseName
  properties: {
    charset: 'UTF8'
    collation: 'en_US.utf8'
  }
  dependsOn: [
    admin
    allowAzureServices
    allowClient
  ]
}

output serverName string = server.name
output fullyQualifiedDomainName string = server.properties.fullyQualifiedDomainName
output databaseName string = database.name
