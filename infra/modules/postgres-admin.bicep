// Makes the Function App's managed identity a Microsoft Entra administrator of the server, so it
// can sign in as the PostgreSQL role named after the app with an Entra access token.

@description('Existing PostgreSQL flexible server.')
param serverName string

@description('Object id of the Function App\'s managed identity.')
param principalId string

@description('Name of that identity (the Function App name); it is also the PostgreSQL role name.')
param principalName string

resource server 'Microsoft.DBforPostgreSQL/flexibleServers@2024-08-01' existing = {
  name: serverName
}

resource admin 'Microsoft.DBforPostgreSQL/flexibleServers/administrators@2024-08-01' = {
  parent: server
  name: principalId
  properties: {
    principalName: principalName
    principalType: 'ServicePrincipal'
    tenantId: tenant().tenantId
  }
}
