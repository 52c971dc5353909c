// Storage account: host storage, the Flex Consumption deployment package, the kit's queues
// (each with its <name>-poison queue) and its control/history tables.

@description('Azure region for the resources.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Storage account name (3-24 lowercase letters and digits, globally unique).')
@minLength(3)
@maxLength(24)
param accountName string

@description('Replication. LRS suits transient queue data; pick ZRS/GZRS where the history must survive a zone or region loss.')
@allowed([
  'Standard_LRS'
  'Standard_ZRS'
  'Standard_GRS'
  'Standard_GZRS'
  'Standard_RAGRS'
  'Standard_RAGZRS'
])
param skuName string = 'Standard_LRS'

@description('Allow account-key (shared key) access. Off: the app and the host use their managed identity.')
param allowSharedKeyAccess bool = false

@description('Storage queue names, one per message type; a <name>-poison queue is created for each.')
param queues array = []

@description('Table for the kit\'s control state (pause/resume).')
param controlTableName string = 'queueingcontrol'

@description('Table for the kit\'s message history (tracker).')
param trackerTableName string = 'queueinghistory'

@description('Blob container holding the Flex Consumption deployment package.')
param deploymentContainerName string = 'app-package'

resource account 'Microsoft.Storage/storageAccounts@2023-05-01' = {
  name: accountName // checkov:skip=CKV_AZURE_43: the name is a parameter (checkov reads its identifier as the name); main.bicep builds it from lowercase letters/digits, max 24
  location: location
  tags: tags
  kind: 'StorageV2'
  sku: {
    name: skuName // checkov:skip=CKV_AZURE_206: replication is the skuName parameter; LRS default because queue messages and history are transient
  }
  properties: {
    accessTier: 'Hot'
    minimumTlsVersion: 'TLS1_2'
    supportsHttpsTrafficOnly: true
    allowBlobPublicAccess: false
    allowSharedKeyAccess: allowSharedKeyAccess
    defaultToOAuthAuthentication: true
    allowCrossTenantReplication: false
    publicNetworkAccess: 'Enabled' // checkov:skip=CKV_AZURE_59: Flex Consumption without VNet integration reaches storage over its public endpoint; data access needs an Entra identity (shared key off by default)
    networkAcls: {
      bypass: 'AzureServices'
      defaultAction: 'Allow' // checkov:skip=CKV_AZURE_35: there is no VNet in this template, so deny-by-default would lock the Function App out
    }
  }
}

resource blobService 'Microsoft.Storage/storageAccounts/blobServices@2023-05-01' = {
  parent: account
  name: 'default'
  properties: {
    deleteRetentionPolicy: {
      enabled: true
      days: 7
    }
  }
}

resource deploymentContainer 'Microsoft.Storage/storageAccounts/blobServices/containers@2023-05-01' = {
  parent: blobService
  name: deploymentContainerName
  properties: {
    publicAccess: 'None'
  }
}

resource queueService 'Microsoft.Storage/storageAccounts/queueServices@2023-05-01' = {
  parent: account
  name: 'default'
}

resource queue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = [for queueName in queues: {
  parent: queueService
  name: queueName
}]

// The Functions host moves a message here after maxDequeueCount failed attempts.
resource poisonQueue 'Microsoft.Storage/storageAccounts/queueServices/queues@2023-05-01' = [for queueName in queues: {
  parent: queueService
  name: '${queueName}-poison'
}]

resource tableService 'Microsoft.Storage/storageAccounts/tableServices@2023-05-01' = {
  parent: account
  name: 'default'
}

resource controlTable 'Microsoft.Storage/storageAccounts/tableServices/tables@2023-05-01' = {
  parent: tableService
  name: controlTableName
}

resource trackerTable 'Microsoft.Storage/storageAccounts/tableServices/tables@2023-05-01' = {
  parent: tableService
  name: trackerTableName
}

output accountName string = account.name
// primaryEndpoints end with '/'; the connection settings (docs/azure-settings.md) use the bare URI.
output blobEndpoint string = account.properties.primaryEndpoints.blob
output queueServiceUri string = 'https://${account.name}.queue.${environment().suffixes.storage}'
output tableServiceUri string = 'https://${account.name}.table.${environment().suffixes.storage}'
output deploymentContainerName string = deploymentContainer.name
