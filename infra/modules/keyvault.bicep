// Key Vault holding the ops API key. The Function App reads it through a Key Vault reference app
// setting (QUEUEING_API_KEY), resolved by the platform with the app's user-assigned identity, which
// holds Key Vault Secrets User (roles.bicep); no key is ever in an app setting or a file.

@description('Azure region for the vault.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Vault name (3-24 letters, digits and hyphens, globally unique).')
@minLength(3)
@maxLength(24)
param vaultName string

@description('Name of the secret holding the ops API key.')
param apiKeySecretName string = 'queueing-api-key'

@description('The ops API key (QUEUEING_API_KEY).')
@secure()
param apiKey string

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' = {
  name: vaultName
  location: location
  tags: tags
  properties: {
    tenantId: tenant().tenantId
    sku: {
      family: 'A'
      name: 'standard'
    }
    enableRbacAuthorization: true // access by role assignment (Key Vault Secrets User), no access policies
    enableSoftDelete: true
    softDeleteRetentionInDays: 90
    enablePurgeProtection: true
    publicNetworkAccess: 'Enabled' // checkov:skip=CKV_AZURE_189: Key Vault references from a Flex Consumption app without a VNet are resolved over the vault's public endpoint; access still needs the app identity's role
    networkAcls: {
      bypass: 'AzureServices'
      defaultAction: 'Allow' // checkov:skip=CKV_AZURE_109: there is no VNet in this template, so deny-by-default would stop the platform resolving the app's Key Vault reference
    }
  }
}

resource apiKeySecret 'Microsoft.KeyVault/vaults/secrets@2023-07-01' = {
  parent: vault
  name: apiKeySecretName
  properties: {
    value: apiKey
    contentType: 'text/plain'
    // checkov:skip=CKV_AZURE_41: the ops API key has no natural expiry; rotate it by redeploying with a new apiKey (the reference reads the latest version)
  }
}

output vaultName string = vault.name
// without a version: the Key Vault reference follows the latest version of the secret
output apiKeySecretUri string = apiKeySecret.properties.secretUri
