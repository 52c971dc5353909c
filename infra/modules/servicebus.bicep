// Service Bus namespace and one queue per message type. Dead letters land in each queue's
// native sub-queue ($DeadLetterQueue), so no separate poison queues are created here.

@description('Azure region for the resources.')
param location string

@description('Tags applied to every resource.')
param tags object = {}

@description('Service Bus namespace name (6-50 characters, globally unique).')
@minLength(6)
@maxLength(50)
param namespaceName string

@description('Disable SAS keys (local auth) so only Microsoft Entra identities can connect.')
param disableLocalAuth bool = true

@description('''Queues to create. Each entry: { name: string, maxDeliveryCount: int (1-2000),
lockDuration: ISO 8601 duration (max PT5M), defaultMessageTimeToLive: ISO 8601 duration,
requiresDuplicateDetection: bool, duplicateDetectionHistoryTimeWindow?: ISO 8601 duration }.''')
param queues array = []

resource namespace 'Microsoft.ServiceBus/namespaces@2024-01-01' = {
  name: namespaceName
  location: location
  tags: tags
  sku: {
    name: 'Standard'
    tier: 'Standard'
  }
  properties: {
    minimumTlsVersion: '1.2'
    disableLocalAuth: disableLocalAuth
    publicNetworkAccess: 'Enabled' // Flex Consumption without a VNet reaches the namespace publicly
  }
}

resource queue 'Microsoft.ServiceBus/namespaces/queues@2024-01-01' = [for q in queues: {
  parent: namespace
  name: q.name
  properties: {
    maxDeliveryCount: q.maxDeliveryCount
    lockDuration: q.lockDuration
    defaultMessageTimeToLive: q.defaultMessageTimeToLive
    // requiresDuplicateDetection cannot be changed after the queue exists.
    requiresDuplicateDetection: q.requiresDuplicateDetection
    duplicateDetectionHistoryTimeWindow: contains(q, 'duplicateDetectionHistoryTimeWindow') ? q.duplicateDetectionHistoryTimeWindow : 'PT10M'
    // An expired message is kept for inspection and retry instead of vanishing.
    deadLetteringOnMessageExpiration: true
    enableBatchedOperations: true
  }
}]

output namespaceName string = namespace.name
// serviceBusEndpoint is https://<ns>.servicebus.windows.net:443/ (cloud-specific suffix); the
// identity connection wants the bare host name.
output fullyQualifiedNamespace string = replace(replace(namespace.properties.serviceBusEndpoint, 'https://', ''), ':443/', '')
