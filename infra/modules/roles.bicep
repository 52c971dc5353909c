// Least-privilege data-plane roles for the Function App's user-assigned identity. They are assigned
// before the app exists (main.bicep makes the app wait for this module), so the host's first start and
// the first publish find them in place.
//
// What each right lets the app do is held against the runtime by tests/infra/test_provisioned.py: the
// kit starts and processes a message on each transport with exactly these roles.

@description('Object (principal) id of the app\'s managed identity.')
param principalId string

@description('Service Bus namespace the app sends to and receives from.')
param serviceBusNamespaceName string

@description('Storage account holding host storage, the package, the queues and the tables.')
param storageAccountName string

@description('Application Insights component the app sends telemetry to (Entra ingestion).')
param appInsightsName string

@description('Key Vault holding the ops API key.')
param keyVaultName string

// Built-in role definition ids (the same in every tenant).
var serviceBusDataReceiver = '4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0'
var serviceBusDataSender = '69a216fc-b8fb-44d8-bc22-1f3c2cd27a39'
var storageQueueDataContributor = '974c5e8b-45b9-4653-ba55-5f855dd0fb88'
var storageTableDataContributor = '0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3'
var storageBlobDataOwner = 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'
var monitoringMetricsPublisher = '3913510d-42f4-4e42-8a64-420c390055eb'
var keyVaultSecretsUser = '4633458b-17de-408a-b874-0445c86b69e6'

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: serviceBusNamespaceName
}

resource account 'Microsoft.Storage/storageAccounts@2023-05-01' existing = {
  name: storageAccountName
}

resource appInsights 'Microsoft.Insights/components@2020-02-02' existing = {
  name: appInsightsName
}

resource vault 'Microsoft.KeyVault/vaults@2023-07-01' existing = {
  name: keyVaultName
}

// Receiver + Sender cover triggers, settlement and enqueueing follow-up messages. Neither carries the
// Manage right: the queues are provisioned here (servicebus.bicep) and the app does not create them
// (QUEUEING_SERVICEBUS_CREATE_QUEUES=false); GET stats counts by peeking instead of reading queue
// runtime properties. Accurate target-based scaling of Service Bus triggers also wants Azure Service
// Bus Data Owner (090c5cfd-751d-490a-894a-3ce6f1109419); without it the scale controller estimates the
// backlog by peeking. Grant Data Owner only if that matters more than least privilege.
resource sbReceiver 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(namespace.id, principalId, serviceBusDataReceiver)
  scope: namespace
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', serviceBusDataReceiver)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

resource sbSender 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(namespace.id, principalId, serviceBusDataSender)
  scope: namespace
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', serviceBusDataSender)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

// Queue triggers, sends and poison queues.
resource queueContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(account.id, principalId, storageQueueDataContributor)
  scope: account
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageQueueDataContributor)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

// The kit's control and history tables.
resource tableContributor 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(account.id, principalId, storageTableDataContributor)
  scope: account
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageTableDataContributor)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

// Host storage (blob leases, timer locks) and the Flex Consumption deployment package.
resource blobOwner 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(account.id, principalId, storageBlobDataOwner)
  scope: account
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', storageBlobDataOwner)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

// Telemetry with Entra ingestion (APPLICATIONINSIGHTS_AUTHENTICATION_STRING); local auth is off.
resource metricsPublisher 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(appInsights.id, principalId, monitoringMetricsPublisher)
  scope: appInsights
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', monitoringMetricsPublisher)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}

// The Key Vault reference behind QUEUEING_API_KEY.
resource secretsUser 'Microsoft.Authorization/roleAssignments@2022-04-01' = {
  name: guid(vault.id, principalId, keyVaultSecretsUser)
  scope: vault
  properties: {
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', keyVaultSecretsUser)
    principalId: principalId
    principalType: 'ServicePrincipal'
  }
}
