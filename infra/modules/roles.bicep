// Least-privilege data-plane roles for the Function App's system-assigned identity.

@description('Object id of the Function App\'s managed identity.')
param principalId string

@description('Service Bus namespace the app sends to and receives from.')
param serviceBusNamespaceName string

@description('Storage account holding host storage, the package, the queues and the tables.')
param storageAccountName string

// Built-in role definition ids (the same in every tenant).
var serviceBusDataReceiver = '4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0'
var serviceBusDataSender = '69a216fc-b8fb-44d8-bc22-1f3c2cd27a39'
var storageQueueDataContributor = '974c5e8b-45b9-4653-ba55-5f855dd0fb88'
var storageTableDataContributor = '0a9a7e1f-b9d0-4cc4-a60d-0319b160aaa3'
var storageBlobDataOwner = 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' existing = {
  name: serviceBusNamespaceName
}

resource account 'Microsoft.Storage/storageAccounts@2023-05-01' existing = {
  name: storageAccountName
}

// Receiver + Sender cover triggers, settlement and enqueueing follow-up messages. Accurate
// target-based scaling of Service Bus triggers wants Azure Service Bus Data Owner
// (090c5cfd-751d-490a-894a-3ce6f1109419) to read queue runtime properties; without it the scale
// controller estimates the backlog by peeking. Grant Data Owner only if that matters more than
// least privilege.
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
