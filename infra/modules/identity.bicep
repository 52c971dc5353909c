// The Function App's user-assigned managed identity. It exists, with its role assignments, before the
// app does: the first publish right after the deployment finds its rights in place (a system-assigned
// identity is born with the app, so its new role assignments can still be propagating then).

@description('Azure region for the identity.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Identity name; it is also the PostgreSQL role the app signs in as.')
param identityName string

resource identity 'Microsoft.ManagedIdentity/userAssignedIdentities@2023-01-31' = {
  name: identityName
  location: location
  tags: tags
}

output id string = identity.id
output name string = identity.name
output clientId string = identity.properties.clientId
output principalId string = identity.properties.principalId
