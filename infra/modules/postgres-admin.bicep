// The server's Microsoft Entra administrator: the person or group who deploys (their object id is a
// parameter), never the app. The administrator then creates the app's own least-privilege role once,
// with infra/postgres/app-role.sql (see infra/README.md), which pgaadauth_create_principal maps to the
// app's managed identity by name.

@description('Existing PostgreSQL flexible server.')
param serverName string

@description('Object id of the Entra user, group or service principal to make administrator.')
param principalId string

@description('Display name of that principal (a user principal name, or the group\'s name).')
param principalName string

@description('What the principal is.')
@allowed([
  'User'
  'Group'
  'ServicePrincipal'
])
param principalType string = 'User'

resource server 'Microsoft.DBforPostgreSQL/flexibleServers@2024-08-01' existing = {
  name: serverName
}

resource admin 'Microsoft.DBforPostgreSQL/flexibleServers/administrators@2024-08-01' = {
  parent: server
  name: principalId
  properties: {
    principalName: principalName
    principalType: principalType
    tenantId: tenant().tenantId
  }
}
