// Function App on the Flex Consumption plan (Linux, Python 3.11) running as a user-assigned identity.
// Every connection is identity-based and names that identity's client id (<Conn>__credential and
// __clientId: without them the SDKs would look for a system-assigned identity the app does not have);
// the setting names are the ones in docs/azure-settings.md.

@description('Azure region for the resources.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Flex Consumption plan name.')
param planName string

@description('Function App name (globally unique host name).')
param appName string

@description('Storage account for host storage and the deployment package.')
param storageAccountName string

@description('Blob endpoint of that storage account (ends with /).')
param storageBlobEndpoint string

@description('Blob container holding the deployment package.')
param deploymentContainerName string

@description('Queue service URI for the QueueingStorage connection.')
param storageQueueServiceUri string

@description('Table service URI for the QueueingStorage connection.')
param storageTableServiceUri string

@description('Service Bus host name for the QueueingServiceBus connection.')
param serviceBusFullyQualifiedNamespace string

@description('Application Insights component (in this resource group) receiving telemetry.')
param appInsightsName string

@description('Resource id of the app\'s user-assigned managed identity.')
param identityId string

@description('Client id of that identity: what every identity-based connection of the app signs in as.')
param identityClientId string

@description('Upper bound on instances the plan scales out to (Flex Consumption accepts 40 to 1000).')
@minValue(40)
@maxValue(1000)
param maximumInstanceCount int = 100

@description('Memory per instance in MB.')
@allowed([
  512
  2048
  4096
])
param instanceMemoryMB int = 2048

@description('Transport the kit uses: QUEUEING_PROVIDER.')
@allowed([
  'servicebus'
  'storage_queue'
  'sql'
])
param queueingProvider string = 'servicebus'

@description('The kit app to host, MODULE:ATTR: QUEUEING_APP.')
param queueingApp string = 'queueing_core.examples.orders:app'

@description('Control-state table name: QUEUEING_CONTROL_TABLE.')
param controlTableName string = 'queueingcontrol'

@description('History (tracker) table name: QUEUEING_TRACKER_TABLE.')
param trackerTableName string = 'queueinghistory'

@description('Days of message history kept: QUEUEING_TRACKER_RETENTION_DAYS.')
@minValue(1)
@maxValue(3650)
param trackerRetentionDays int = 14

@description('Prefix composed into every queue name: QUEUEING_QUEUE_PREFIX (must match the queue names provisioned).')
param queuePrefix string = ''

@description('Suffix composed into every queue name: QUEUEING_QUEUE_SUFFIX (must match the queue names provisioned).')
param queueSuffix string = ''

@description('Key Vault secret URI (no version) of the ops API key, read through a Key Vault reference: QUEUEING_API_KEY.')
param apiKeySecretUri string

@description('SQLAlchemy URL for the sql provider: QUEUEING_DATABASE_URL; empty leaves the database settings out.')
param databaseUrl string = ''

@description('PostgreSQL schema the kit keeps its tables in (owned by the app\'s role): QUEUEING_DATABASE_SCHEMA.')
param databaseSchema string = 'queueing'

resource appInsights 'Microsoft.Insights/components@2020-02-02' existing = {
  name: appInsightsName
}

resource plan 'Microsoft.Web/serverfarms@2024-04-01' = {
  name: planName
  location: location
  tags: tags
  kind: 'functionapp'
  sku: {
    name: 'FC1'
    tier: 'FlexConsumption'
  }
  properties: {
    reserved: true // Linux
    zoneRedundant: false // checkov:skip=CKV_AZURE_225: availability zones for Flex Consumption depend on the region; opt in where the region supports it
  }
}

var baseSettings = [
  // Host storage through the app's identity (no AzureWebJobsStorage connection string).
  {
    name: 'AzureWebJobsStorage__accountName'
    value: storageAccountName
  }
  {
    name: 'AzureWebJobsStorage__credential'
    value: 'managedidentity'
  }
  {
    name: 'AzureWebJobsStorage__clientId'
    value: identityClientId
  }
  {
    name: 'QueueingServiceBus__fullyQualifiedNamespace'
    value: serviceBusFullyQualifiedNamespace
  }
  {
    name: 'QueueingServiceBus__credential'
    value: 'managedidentity'
  }
  {
    name: 'QueueingServiceBus__clientId'
    value: identityClientId
  }
  {
    name: 'QueueingStorage__queueServiceUri'
    value: storageQueueServiceUri
  }
  {
    name: 'QueueingStorage__tableServiceUri'
    value: storageTableServiceUri
  }
  {
    name: 'QueueingStorage__credential'
    value: 'managedidentity'
  }
  {
    name: 'QueueingStorage__clientId'
    value: identityClientId
  }
  {
    name: 'QUEUEING_PROVIDER'
    value: queueingProvider
  }
  {
    name: 'QUEUEING_APP'
    value: queueingApp
  }
  {
    name: 'QUEUEING_QUEUE_PREFIX'
    value: queuePrefix
  }
  {
    name: 'QUEUEING_QUEUE_SUFFIX'
    value: queueSuffix
  }
  {
    name: 'QUEUEING_CONTROL_TABLE'
    value: controlTableName
  }
  {
    name: 'QUEUEING_TRACKER_TABLE'
    value: trackerTableName
  }
  {
    name: 'QUEUEING_TRACKER_RETENTION_DAYS'
    value: string(trackerRetentionDays)
  }
  // The queues are provisioned by this template; creating them would need the Manage right (Data Owner).
  {
    name: 'QUEUEING_SERVICEBUS_CREATE_QUEUES'
    value: 'false'
  }
  // Each look at a paused or held message is a copy and an execution here: once a minute, not every 5 s.
  {
    name: 'QUEUEING_PAUSE_RECHECK_SECONDS'
    value: '60'
  }
  {
    name: 'APPLICATIONINSIGHTS_CONNECTION_STRING'
    value: appInsights.properties.ConnectionString
  }
  // Entra ingestion: local auth is off on the component; the identity holds Monitoring Metrics Publisher.
  {
    name: 'APPLICATIONINSIGHTS_AUTHENTICATION_STRING'
    value: 'ClientId=${identityClientId};Authorization=AAD'
  }
  // Resolved by the platform with the identity (keyVaultReferenceIdentity below, Key Vault Secrets User).
  {
    name: 'QUEUEING_API_KEY'
    value: '@Microsoft.KeyVault(SecretUri=${apiKeySecretUri})'
  }
]

// The app signs in to PostgreSQL as the role named after its identity, with an Entra token as the password.
var databaseSettings = empty(databaseUrl) ? [] : [
  {
    name: 'QUEUEING_DATABASE_URL'
    value: databaseUrl
  }
  {
    name: 'QUEUEING_DATABASE_SCHEMA'
    value: databaseSchema
  }
  {
    name: 'QUEUEING_DATABASE_AUTH'
    value: 'entra'
  }
  {
    name: 'QUEUEING_DATABASE_CLIENT_ID'
    value: identityClientId
  }
]

resource app 'Microsoft.Web/sites@2024-04-01' = {
  name: appName
  location: location
  tags: tags
  kind: 'functionapp,linux'
  identity: {
    type: 'UserAssigned'
    userAssignedIdentities: {
      '${identityId}': {}
    }
  }
  properties: {
    serverFarmId: plan.id
    httpsOnly: true
    keyVaultReferenceIdentity: identityId // Key Vault references resolve as the user-assigned identity
    // checkov:skip=CKV_AZURE_222: the ops API is served over HTTPS from this app; without a VNet the public endpoint is how it is reached (API key required)
    // checkov:skip=CKV_AZURE_17: callers authenticate with the ops API key, not client certificates
    // checkov:skip=CKV_AZURE_212: Flex Consumption scales from zero by design; instance count is managed by the platform
    // checkov:skip=CKV_AZURE_213: App Service health check evicts instances of always-on plans; Flex instances are event-driven and managed by the scale controller
    siteConfig: {
      minTlsVersion: '1.2'
      scmMinTlsVersion: '1.2'
      ftpsState: 'Disabled'
      http20Enabled: true
      appSettings: concat(baseSettings, databaseSettings)
    }
    functionAppConfig: {
      deployment: {
        storage: {
          type: 'blobContainer'
          value: '${storageBlobEndpoint}${deploymentContainerName}'
          authentication: {
            type: 'UserAssignedIdentity' // needs Storage Blob Data Owner on the account (roles.bicep)
            userAssignedIdentityResourceId: identityId
          }
        }
      }
      scaleAndConcurrency: {
        maximumInstanceCount: maximumInstanceCount
        instanceMemoryMB: instanceMemoryMB
      }
      runtime: {
        name: 'python'
        version: '3.11'
      }
    }
  }
}

output appName string = app.name
output defaultHostName string = app.properties.defaultHostName
