// Sample parameters for the example app (queueing_core/examples/orders.py). Deploy with:
//   export QUEUEING_DEPLOY_API_KEY=<secret>
//   az deployment group create --resource-group <rg> --template-file infra/main.bicep \
//     --parameters infra/main.bicepparam
using 'main.bicep'

// The ops API key, from the environment of the deploying shell or pipeline (a secret there), never
// from this file. Bicep stops with an error naming the variable when it is not set. It cannot be left
// out for the command line to fill in: the Azure CLI compiles this file once without the command
// line's values, and Bicep refuses a file that does not assign every required parameter.
param apiKey = readEnvironmentVariable('QUEUEING_DEPLOY_API_KEY')

param namePrefix = 'queueing'
param queueingProvider = 'servicebus'
param queueingApp = 'queueing_core.examples.orders:app'
param logRetentionDays = 30
param deployPostgres = false
// with deployPostgres: your public IPv4 address, so psql from your machine can run
// infra/postgres/app-role.sql (or run it from Cloud Shell and leave this empty); delete the rule after
param postgresClientIpAddress = ''
// after deleting the resource group: a new value names a new Key Vault (the deleted one keeps its name)
param vaultNameSalt = ''

// The block between the markers is regenerated from the registered message types by the
// queueing CLI (`queueing infra params`); edit the code, not these lines.
// BEGIN GENERATED QUEUES (queueing infra params)
param serviceBusQueues = [
  {
    name: 'capture-payment'
    maxDeliveryCount: 5
    lockDuration: 'PT30S'
    defaultMessageTimeToLive: 'PT5H'
    requiresDuplicateDetection: false
  }
  {
    name: 'generate-invoice'
    maxDeliveryCount: 6
    lockDuration: 'PT1M'
    defaultMessageTimeToLive: 'PT5H'
    requiresDuplicateDetection: false
  }
  {
    name: 'order-placed'
    maxDeliveryCount: 6
    lockDuration: 'PT30S'
    defaultMessageTimeToLive: 'PT5H'
    requiresDuplicateDetection: false
  }
]
param storageQueues = [
  'capture-payment'
  'generate-invoice'
  'order-placed'
]
param queuePrefix = ''
param queueSuffix = ''
// END GENERATED QUEUES
